"""`pdserve bench`, the load generator: `records.py` what is measured and its statistics (pure),
`client.py` the HTTP side, `sweep.py` the arrivals and the sweep of rates, `cli.py` the command,
`plot.py` the charts (--plot; matplotlib, imported only to draw); `steady.py` a steady load on a thread
of its own beside a change (the chaos and flip tests, the role-flip benchmark)."""

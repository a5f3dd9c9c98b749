"""`pdserve bench`, the load generator: `records.py` what is measured and its statistics (pure),
`client.py` the HTTP side, `sweep.py` the arrivals and the sweep of rates, `cli.py` the command,
`plot.py` the charts (--plot; matplotlib, imported only to draw)."""

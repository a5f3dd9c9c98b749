"""What an internal endpoint refused (a connection, a frame, a notice), counted by why.

Counted, not kept: a flood of strangers costs a few integers, not a list that grows with each. The
first refusal of each reason is logged, then every thousandth, so a flood is no flood of lines."""

import logging
from collections import Counter


class Refusals(Counter):
    """reason -> how many; `refuse` counts one and logs it where due."""

    def __init__(self, where: str, log: logging.Logger):
        super().__init__()
        self.where = where
        self._log = log

    def refuse(self, reason: str, detail: str) -> None:
        self[reason] += 1
        if self[reason] == 1 or self[reason] % 1000 == 0:
            self._log.warning("%s: refused %s (%s: %d so far)", self.where, detail, reason, self[reason])

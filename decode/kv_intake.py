"""Takes KV from prefill workers into a decode engine: reserve, wait for the data, start decoding."""

from pdserve.engine.engine import Engine
from pdserve.engine.sampling_params import SamplingParams

from kvtransfer import DecodeConnector, ReserveHandle


class KVIntake:
    def __init__(self, engine: Engine, connector: DecodeConnector, lease_s: float = 30.0):
        assert engine.config.role == "decode"
        self.engine = engine
        self.connector = connector
        self.lease_s = lease_s

    def reserve(self, request_id: str, prompt: list[int], params: SamplingParams,
                prefill_id: str | None = None) -> ReserveHandle | None:
        """Blocks for the prompt's KV under a lease, or None when this replica is full."""
        blocks = self.engine.reserve(request_id, prompt, params)
        if blocks is None:
            return None
        return self.connector.reserve(request_id, blocks, self.lease_s, prefill_id)

    def abort(self, request_id: str) -> None:
        self.connector.release(request_id)
        self.engine.abort(request_id)

    def poll(self) -> list[str]:
        """Start the requests whose KV arrived; free the ones that failed (returned)."""
        done, failed = self.connector.poll()
        for f in done:
            self.engine.start_decode(f.request_id, f.first_token)
        for rid in failed:
            self.engine.release(rid)
        return failed

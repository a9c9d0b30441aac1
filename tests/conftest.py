import os

import pytest
import torch

# Two intra-op threads; under pytest-xdist (scripts/test.sh runs two workers) the workers share the
# cores, so each gets its share.
_WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
torch.set_num_threads(2 if _WORKERS == 1 else max(1, min(2, (os.cpu_count() or 1) // _WORKERS)))


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


@pytest.fixture(scope="module")
def one_thread():
    """Tiny models run fastest on one thread (and much faster when other jobs share the cores)."""
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


@pytest.fixture
def kept_positions(monkeypatch):
    """The positions each ``PrefixCache.prefill`` call kept, in call order (the prefix cache's
    command tests: it runs inside ``aiayn generate --chat -``)."""
    from aiayn.decoding.prefix_cache import PrefixCache

    kept: list[int] = []
    original = PrefixCache.prefill

    def recording(self, *args, **kwargs):
        out = original(self, *args, **kwargs)
        kept.append(self.kept)
        return out

    monkeypatch.setattr(PrefixCache, "prefill", recording)
    return kept

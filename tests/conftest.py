import pytest
import torch

from lab import intmm

torch.set_num_threads(2)


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


@pytest.fixture
def one_thread():
    """Tiny models step faster on one thread, and far faster when other processes share the cores.
    Modules that train tiny models use it: ``pytestmark = pytest.mark.usefixtures("one_thread")``."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(params=intmm.INSTRUCTION_SETS)
def instruction_set(request):
    """The kernels in each instruction set this CPU has (the others skip), the default restored after."""
    if (reason := intmm.unavailable()) is not None:
        pytest.skip(reason)
    default = intmm.instruction_set()
    chosen = intmm.instruction_set(request.param)
    if chosen != request.param:
        intmm.instruction_set(default)
        pytest.skip(f"this CPU has no {request.param}")
    yield chosen
    intmm.instruction_set(default)


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip_gpu = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)

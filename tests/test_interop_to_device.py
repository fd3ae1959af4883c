"""``moeref._interop.to_device``: host arrays copied to a device without waiting for it, the staging buffers
reused only once the copy that read them has finished."""
import numpy as np
import pytest

torch = pytest.importorskip("torch")

from moeref import _interop  # noqa: E402

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="to_device's page-locked staging runs on CUDA only")


def test_cpu_device_values_and_dtype():
    assert _interop.to_device(np.float64(2.5), "cpu").shape == ()  # a 0-d array stays 0-d
    a = np.arange(12, dtype=np.float32).reshape(3, 4)
    t = _interop.to_device(a, "cpu")
    assert t.dtype == torch.float32 and t.shape == (3, 4)
    assert np.array_equal(t.numpy(), a)
    assert _interop.to_device(a, "cpu", torch.float64).dtype == torch.float64


@cuda
@pytest.mark.parametrize("dtype", [np.float32, np.float64, np.int64, np.uint8, np.bool_, np.uint16])
@pytest.mark.parametrize("shape", [(), (1,), (3, 5), (4096, 56), (0, 3)])
def test_cuda_copy_is_the_host_array(dtype, shape):
    rng = np.random.default_rng(0)
    a = (rng.integers(0, 200, size=shape) % 2 == 0) if dtype is np.bool_ else \
        rng.integers(0, 200, size=shape).astype(dtype)
    got = _interop.to_device(a, "cuda")
    assert got.device.type == "cuda" and tuple(got.shape) == shape
    assert np.array_equal(got.cpu().numpy(), a)


@cuda
def test_cuda_buffer_not_reused_while_its_copy_waits():
    """Copies queued behind a long kernel: each staging buffer still being read is left alone, so every
    copy lands with its own values (a buffer overwritten before its copy ran would give the last values)."""
    n = 1 << 16
    outs, want = [], []
    torch.cuda._sleep(200_000_000)  # keep the stream busy while the host queues the copies
    for i in range(12):  # more copies of one size than the pool keeps buffers of it
        a = np.full(n, i, dtype=np.float32)
        outs.append(_interop.to_device(a, "cuda"))
        want.append(a)
    torch.cuda.synchronize()
    for got, a in zip(outs, want):
        assert np.array_equal(got.cpu().numpy(), a)


@cuda
def test_cuda_large_array_takes_fresh_pinned_memory():
    a = np.arange((_interop.STAGING_MAX_BYTES // 8) + 3, dtype=np.float64)
    assert np.array_equal(_interop.to_device(a, "cuda").cpu().numpy(), a)


@cuda
def test_cuda_read_only_pinned_array_is_copied_from_where_it_is():
    """A read-only array in page-locked memory (what the converter's reader gives) is copied without staging:
    the values arrive; a writable one, or a read-only view of a writable one, is still staged (a later write
    to it cannot reach the copy)."""
    n = 1 << 20
    buf = torch.empty(n * 4, dtype=torch.uint8, pin_memory=True).numpy()
    buf.view(np.float32)[:] = np.arange(n, dtype=np.float32)
    buf.setflags(write=False)
    a = buf.view(np.float32)
    assert _interop._read_only_pinned(a, torch.from_numpy(a))
    got = _interop.to_device(a, "cuda")
    torch.cuda.synchronize()
    assert np.array_equal(got.cpu().numpy(), np.arange(n, dtype=np.float32))
    w = torch.empty(16, dtype=torch.float32, pin_memory=True).numpy()
    v = w[:]
    v.setflags(write=False)
    assert not _interop._read_only_pinned(w, torch.from_numpy(w))
    assert not _interop._read_only_pinned(v, torch.from_numpy(v))
    plain = np.arange(16, dtype=np.float32)
    plain.setflags(write=False)
    assert not _interop._read_only_pinned(plain, torch.from_numpy(plain))

"""The vLLM connector's memory step (`shared_kv.share`) on host memory, without vLLM: what the
real-vLLM tests rely on at every start, checked here on bytes that are not zeros. The same step
on CUDA memory is in tests/test_gpu.py."""

import pytest

torch = pytest.importorskip("torch")

from kvxferd.vllm.shared_kv import share  # noqa: E402

LAYERS, BLOCKS = 3, 5
PER_LAYER = 2 * BLOCKS * 16 * 2 * 64 * 2  # K and V, blocks of 16 tokens, 2 heads of 64, bf16


@pytest.mark.parametrize("written", [True, False], ids=["written", "fresh"])
def test_share_moves_the_caches_into_a_memfd_and_gives_their_buffer_back(written):
    """Layer caches viewing one buffer, as vLLM's CPU allocator makes them, and one more live
    view: all re-pointed at a memfd holding the same bytes (what another process reads through
    the fd), the private buffer given back, and later writes land in the shared pages."""
    backing = torch.zeros(LAYERS * PER_LAYER, dtype=torch.uint8)
    if written:
        backing.copy_(torch.randint(0, 256, backing.shape, dtype=torch.uint8,
                                    generator=torch.Generator().manual_seed(3)))
    caches = {f"model.layers.{i}.self_attn.attn": backing[i * PER_LAYER:(i + 1) * PER_LAYER]
              .view(torch.bfloat16).view(2, BLOCKS, 16, 2, 64) for i in range(LAYERS)}
    bound = backing.view(torch.bfloat16)  # as an attention layer's bound cache
    private = backing.untyped_storage()
    before = backing.clone()
    del backing

    buffers, where = share(caches, also=[bound])

    assert len(buffers) == 1
    buf = buffers[0]
    assert buf.kind == "shm" and buf.nbytes == LAYERS * PER_LAYER
    assert {t.untyped_storage().data_ptr() for t in [*caches.values(), bound]} == {buf.address}
    assert where == {name: (0, i * PER_LAYER) for i, name in enumerate(caches)}
    assert private.nbytes() == 0  # given back before the memfd was made
    assert torch.equal(bound.view(torch.uint8), before)
    caches["model.layers.1.self_attn.attn"][1, 3].fill_(1.5)
    with open(f"/proc/self/fd/{buf.fd}", "rb") as f:  # the pages the daemon maps
        assert f.read() == bytes(bound.view(torch.uint8).numpy())
    assert not torch.equal(bound.view(torch.uint8), before)
    buf.close()

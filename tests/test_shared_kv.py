"""The vLLM connector's memory step (`shared_kv.share`) on host memory, without vLLM: what the
real-vLLM tests rely on at every start, checked here on bytes that are not zeros, and where it
cannot give the private buffer back. The same step on CUDA memory is in tests/test_gpu.py."""

import logging

import pytest

torch = pytest.importorskip("torch")

from kvxferd.vllm import shared_kv  # noqa: E402

LAYERS, BLOCKS = 3, 5
PER_LAYER = 2 * BLOCKS * 16 * 2 * 64 * 2  # K and V, blocks of 16 tokens, 2 heads of 64, bf16
FIRST = "model.layers.1.self_attn.attn"


def caches(backing):
    """Layer caches viewing one buffer, as vLLM's CPU allocator makes them."""
    return {f"model.layers.{i}.self_attn.attn": backing[i * PER_LAYER:(i + 1) * PER_LAYER]
            .view(torch.bfloat16).view(2, BLOCKS, 16, 2, 64) for i in range(LAYERS)}


def written(backing):
    backing.copy_(torch.randint(0, 256, backing.shape, dtype=torch.uint8, generator=torch.Generator().manual_seed(3)))
    return backing


def shared_bytes(buf) -> bytes:
    with open(f"/proc/self/fd/{buf.fd}", "rb") as f:  # the pages the daemon maps
        return f.read()


@pytest.mark.parametrize("fill", [True, False], ids=["written", "fresh"])
def test_share_gives_the_private_buffer_back_before_it_allocates_the_shared_one(monkeypatch, fill):
    """Every view (and one more live one) re-pointed at a memfd holding the same bytes, the
    private buffer given back before the memfd is made, later writes in the shared pages."""
    backing = torch.zeros(LAYERS * PER_LAYER, dtype=torch.uint8)
    if fill:
        written(backing)
    layers = caches(backing)
    bound = backing.view(torch.bfloat16)  # as an attention layer's bound cache
    private = backing.untyped_storage()
    before = backing.clone()
    del backing
    allocate = shared_kv._allocate
    sizes_when_allocating = []
    monkeypatch.setattr(shared_kv, "_allocate",
                        lambda n, d: sizes_when_allocating.append(private.nbytes()) or allocate(n, d))

    buffers, where = shared_kv.share(layers, also=[bound])

    assert sizes_when_allocating == [0]
    assert len(buffers) == 1
    buf = buffers[0]
    assert buf.kind == "shm" and buf.nbytes == LAYERS * PER_LAYER
    assert {t.untyped_storage().data_ptr() for t in [*layers.values(), bound]} == {buf.address}
    assert where == {name: (0, i * PER_LAYER) for i, name in enumerate(layers)}
    assert torch.equal(bound.view(torch.uint8), before)
    layers[FIRST][1, 3].fill_(1.5)
    assert shared_bytes(buf) == bytes(bound.view(torch.uint8).numpy())
    assert not torch.equal(bound.view(torch.uint8), before)
    buf.close()


def test_a_holder_not_found_keeps_the_private_buffer_and_the_copy_is_made_beside_it(monkeypatch, caplog):
    """A tensor the scan cannot see would read freed memory if the buffer were given back: it
    is not; the views found move to the shared copy, and the log says why two copies exist."""
    backing = written(torch.zeros(LAYERS * PER_LAYER, dtype=torch.uint8))
    layers = caches(backing)
    hidden = backing[:16]
    hidden_before = hidden.clone()
    find = shared_kv._views_of
    monkeypatch.setattr(shared_kv, "_views_of",
                        lambda storages, known: {p: [t for t in ts if t is not hidden] for p, ts in
                                                 find(storages, known).items()})
    with caplog.at_level(logging.WARNING, "kvxferd.vllm"):
        buffers, _ = shared_kv.share(layers, also=[backing])
    assert hidden.untyped_storage().nbytes() == LAYERS * PER_LAYER  # still there, with its bytes
    assert torch.equal(hidden, hidden_before)
    assert backing.untyped_storage().data_ptr() == buffers[0].address  # the views found moved
    assert shared_bytes(buffers[0]) == bytes(hidden.untyped_storage())
    assert "copied beside its private one" in caplog.text and "views found" in caplog.text
    buffers[0].close()


def test_a_storage_torch_did_not_allocate_is_copied_beside_it():
    data = bytearray(written(torch.zeros(LAYERS * PER_LAYER, dtype=torch.uint8)).numpy().tobytes())
    backing = torch.frombuffer(data, dtype=torch.uint8)
    layers = caches(backing)
    buffers, _ = shared_kv.share(layers, also=[backing])
    assert shared_bytes(buffers[0]) == bytes(data)
    assert backing.untyped_storage().data_ptr() == buffers[0].address
    buffers[0].close()


def test_no_shared_memory_leaves_the_cache_as_it_was_and_says_how_much_was_asked(monkeypatch):
    backing = written(torch.zeros(LAYERS * PER_LAYER, dtype=torch.uint8))
    layers = caches(backing)
    before = backing.clone()

    def refuse(nbytes, device):
        raise OSError(28, "No space left on device")
    monkeypatch.setattr(shared_kv, "_allocate", refuse)
    with pytest.raises(RuntimeError, match=f"no shareable cpu memory for a KV cache buffer of {LAYERS * PER_LAYER} B"):
        shared_kv.share(layers, also=[backing])
    assert torch.equal(backing, before)
    layers[FIRST].fill_(2.0)  # still usable memory

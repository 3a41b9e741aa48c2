"""The adoption into fixed-address arenas (engine/backends/vmm.py), on the host stand-in arena:
every tensor reachable from the roots is repointed in place into the arena with its values, views
keep sharing their base, a storage also held from outside is refused before anything moves, a
release loses the bytes and copy_into puts a fresh build's back. The CUDA arena itself is tested on
the GPU (tests/gpu/test_suspend_fixed_cuda.py)."""
from __future__ import annotations

import pytest
import torch

from ninfer.engine.backends import vmm
from ninfer.errors import NInferError

CPU = torch.device("cpu")


class Layer:
    def __init__(self, seed: int) -> None:
        g = torch.Generator().manual_seed(seed)
        self.w = torch.randn(8, 16, generator=g)
        self.w_t = self.w.t()  # a view over the same storage
        self.bias = torch.randn(16, generator=g).to(torch.bfloat16)
        self.codes = torch.randint(0, 255, (4, 9), generator=g, dtype=torch.uint8).view(torch.float8_e4m3fn)


class Ops:
    def __init__(self) -> None:
        self.table = torch.arange(10, dtype=torch.float32)


class Model:
    def __init__(self, seed: int) -> None:
        self.layers = [Layer(seed + i) for i in range(3)]
        self.ops = Ops()  # reached from the model, left to its own group
        self.extra = {"scale": torch.tensor([2.0])}


def inside(t: torch.Tensor, arena: vmm.HostArena) -> bool:
    return arena.address <= t.data_ptr() < arena.address + arena.capacity


def test_adopt_repoints_every_tensor_in_place_and_copy_into_restores_a_fresh_build() -> None:
    model = Model(0)
    reference = Model(0)
    ids = (id(model.layers[0].w), id(model.layers[0].w_t))
    adopted = vmm.adopt(vmm.Skip(model, (Ops,)), CPU, arena_type=vmm.HostArena)
    arena, blocks = adopted.arena, adopted.blocks
    assert (id(model.layers[0].w), id(model.layers[0].w_t)) == ids  # the same objects, repointed
    for got, want in zip(model.layers, reference.layers):
        for name in ("w", "w_t", "bias"):
            assert inside(getattr(got, name), arena) and torch.equal(getattr(got, name), getattr(want, name))
        assert torch.equal(got.codes.view(torch.uint8), want.codes.view(torch.uint8))
    assert not inside(model.ops.table, arena)  # skipped type
    assert len(blocks) == 3 * 3 + 1  # w (with its view), bias, codes per layer, and the scale
    model.layers[1].w[0, 0] = 42.0  # a view still shares its base's (new) storage
    assert model.layers[1].w_t[0, 0] == 42.0
    assert all((b.data_ptr() - arena.address) % vmm.ALIGN == 0 for b in blocks)

    arena.release()  # the physical memory is gone: the bytes are not what they were
    assert not torch.equal(model.layers[2].w, reference.layers[2].w)
    arena.restore()
    assert vmm.copy_into(adopted, vmm.Skip(Model(0), (Ops,)), CPU) == sum(b.numel() for b in blocks)
    for got, want in zip(model.layers, reference.layers):
        assert torch.equal(got.w, want.w) and torch.equal(got.w_t, want.w_t) and torch.equal(got.bias, want.bias)


def test_a_storage_held_from_outside_is_refused_before_anything_moves() -> None:
    model = Model(1)
    outside = model.layers[2].w[1:3]  # a view the walk does not reach
    before = [layer.w.data_ptr() for layer in model.layers]
    assert vmm.movable(vmm.storages(model, CPU)) is not None
    with pytest.raises(NInferError, match="fixed addresses"):
        vmm.adopt(model, CPU, arena_type=vmm.HostArena)
    assert [layer.w.data_ptr() for layer in model.layers] == before
    del outside
    assert vmm.movable(vmm.storages(model, CPU)) is None


def test_copy_into_refuses_a_different_layout() -> None:
    model = Model(2)
    adopted = vmm.adopt(model, CPU, arena_type=vmm.HostArena)
    other = Model(2)
    other.layers.pop()
    with pytest.raises(NInferError, match="differ in layout"):
        vmm.copy_into(adopted, other, CPU)


def test_storages_already_in_an_arena_stay_and_a_fresh_build_copies_by_position() -> None:
    """A later adoption leaves what an earlier one took (the ops' table, reached from the model
    too), and copy_into skips the same walk positions of a fresh build."""
    model = Model(3)
    first = vmm.adopt(model.ops, CPU, arena_type=vmm.HostArena)
    second = vmm.adopt(model, CPU, arena_type=vmm.HostArena, after=[first.arena])
    walk = vmm.storages(model, CPU)
    assert len(walk) == 3 * 3 + 2 and len(second.taken) == len(walk) - 1
    skipped = [i for i in range(len(walk)) if i not in second.taken]
    assert [walk[i][0].data_ptr() for i in skipped] == [model.ops.table.data_ptr()]
    assert first.arena.address <= model.ops.table.data_ptr() < first.arena.address + first.arena.capacity
    second.arena.release()
    second.arena.restore()
    vmm.copy_into(second, Model(3), CPU)
    assert all(torch.equal(a.w, b.w) for a, b in zip(model.layers, Model(3).layers))

"""Hidden-state edits on CUDA, checked without a GPU (``tllm_core.testing.fake_cuda``, the
runtime's step driven by ``tests/edit_steps.py``): a steady step of ``steer`` (on
every request and per request) and of each edit kind (add, replace, ablate, transform, an
add of a CPU vector) makes the host wait for nothing, copies nothing from pageable memory,
allocates nothing on the device and races nothing. On CPU the buffers hold what a plain
reference write gives (written out here: advanced-index writes, each step's values moved and
normalised anew), bit for bit, in float32 and bfloat16."""

from __future__ import annotations

import warnings

import numpy as np
import pytest
import torch
from edit_steps import KINDS, run

from tllm_core.api.edits import EditBuffers
from tllm_core.runtime.buffer_pool import StepIndices
from tllm_core.testing.fake_cuda import FakeCuda

H, ROWS = 16, 8
CPU = torch.device("cpu")


@pytest.mark.parametrize("inference", [False, True], ids=["plain", "inference_mode"])
@pytest.mark.parametrize("case", ["steer_all", "steer_per_request", *KINDS])
def test_an_editing_step_on_a_gpu_waits_for_nothing_and_allocates_nothing(case, inference):
    """As is, and in inference mode as vLLM runs a step (the fake does not see every
    operation on an inference tensor there; its values made anew are counted instead)."""
    res = run(case, steps=2, inference=inference)
    assert res["consumer_errors"] == 0, res
    counts = [res[k] for k in ("host_wait", "pageable_copy", "allocation", "race")]
    assert counts == [0, 0, 0, 0], res
    # No value moved or converted anew (an inference tensor's would be: the fake does not
    # count its operations).
    assert res["values_prepared"] == 0, res


def _written_as_before(buf: EditBuffers, plans: list[list[tuple]], owners: list[str]):
    """The buffers as the earlier ``EditBuffers.write`` (and ``EditPlan.ablate``'s
    normalisation) left them: new tensors ``(mask, keep, add, dir, transform masks)``."""
    mask, keep = torch.zeros_like(buf.mask), torch.ones_like(buf.keep)
    add, dirs = torch.zeros_like(buf.add), torch.zeros_like(buf.dir)
    tmasks = [torch.zeros_like(m) for _, _, m in buf.transforms]
    for ops, owner in zip(plans, owners, strict=True):
        for rows, kind, value in ops:
            idx = torch.from_numpy(rows)
            if kind == "transform":
                for (name, _, _), m in zip(buf.transforms, tmasks, strict=True):
                    if name == owner:
                        m[idx] = True
                continue
            if kind == "ablate":
                d = value.float()
                value = d / d.norm(dim=-1, keepdim=True).clamp_min(1e-12)
            v = value.to(dtype=add.dtype)
            if kind == "add":
                add[idx] += v
            elif kind == "replace":
                keep[idx] = 0
                dirs[idx] = 0
                add[idx] = v if v.dim() == 2 else v.expand(len(rows), -1)
            elif kind == "ablate":
                dirs[idx] = v if v.dim() == 2 else v.expand(len(rows), -1)
            mask[idx] = True
    return mask, keep, add, dirs, tmasks


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_edit_buffers_hold_what_they_held_before(dtype):
    """Two consumers' plans (every kind, vectors and per-row values, a direction not of unit
    length) over three steps: the second reuses the kept vectors, the third follows a vector
    changed in place (its version: not the kept copy)."""
    g = torch.Generator().manual_seed(0)
    vec, u, rep = (torch.randn(H, generator=g) for _ in range(3))
    u3 = 3 * u
    per_row = torch.randn(2, H, generator=g)
    dirs2 = torch.randn(2, H, generator=g)
    a = [
        (np.array([0, 2, 5]), "add", vec),
        (np.array([1, 3]), "replace", per_row),
        (np.array([0, 4]), "ablate", u3),
        (np.array([4, 5]), "add", per_row),
        (np.array([2, 6]), "transform", torch.empty(0)),
        (np.array([6, 7]), "ablate", dirs2),
    ]
    b = [
        (np.array([0, 1]), "ablate", u3),  # the same direction tensor as a's on row 0
        (np.array([0, 1]), "add", vec),
        (np.array([6]), "replace", rep),
        (np.array([3]), "transform", torch.empty(0)),
    ]
    buf = EditBuffers(ROWS, H, dtype, CPU)
    for owner in ("a", "b"):
        buf.add_transform(owner, torch.nn.Identity())
    for step in range(3):
        if step == 2:
            vec.mul_(-2)  # the kept copy is stale now
        buf.reset()
        for ops, owner in ((a, "a"), (b, "b")):
            buf.check(ops, owner)
            buf.write(ops, owner)
        mask, keep, add, dirs, tmasks = _written_as_before(buf, [a, b], ["a", "b"])
        assert torch.equal(buf.mask, mask) and torch.equal(buf.keep, keep)
        assert torch.equal(buf.add, add) and torch.equal(buf.dir, dirs)
        for (_, _, m), want in zip(buf.transforms, tmasks, strict=True):
            assert torch.equal(m, want)


def test_a_second_ablation_is_refused_only_for_another_direction():
    """A second ablation of a row: the same direction (the same tensor, or an equal one) is
    allowed, another one is refused, and a row a replace cleared may take another."""
    g = torch.Generator().manual_seed(1)
    u, w = torch.randn(H, generator=g), torch.randn(H, generator=g)
    buf = EditBuffers(ROWS, H, torch.float32, CPU)
    first = [(np.array([0, 1, 2]), "ablate", u), (np.array([2]), "replace", w)]
    buf.check(first, "x")
    buf.write(first)
    buf.check([(np.array([0, 1]), "ablate", u)], "x")  # the same tensor
    buf.check([(np.array([0, 1]), "ablate", u.clone() * 2)], "x")  # an equal direction
    buf.check([(np.array([2, 3]), "ablate", w)], "x")  # row 2 was replaced
    with pytest.raises(ValueError, match="second, different ablation direction"):
        buf.check([(np.array([3, 1]), "ablate", w)], "x")


@pytest.mark.parametrize("second", ["same tensor", "after a replace"])
def test_a_second_ablation_reads_nothing_from_the_device_where_it_cannot_clash(second):
    """A second consumer ablating rows with the direction tensor the first used, or rows
    the first replaced after ablating them: nothing is compared on the device (a comparison
    there would be a host read every step)."""
    with FakeCuda(order=True) as fc:
        buf = EditBuffers(ROWS, H, torch.float32, fc.device)
        steps = StepIndices()
        u, w = torch.randn(H).to(fc.device), torch.randn(H).to(fc.device)
        rows = np.array([0, 1, 2])
        first = [(rows, "ablate", u)]
        if second == "after a replace":
            first.append((rows, "replace", w))
        plans = [first, [(rows, "ablate", u if second == "same tensor" else w)]]

        def one() -> None:
            steps.release()
            buf.reset()
            for ops in plans:
                steps.send([r for r, _, _ in ops], fc.device)
                buf.check(ops, "layer.1", steps.index)
                buf.write(ops, "", steps.index)

        one()
        with fc.steps():
            one()
            one()
        found = [f"{f.kind} {f.where}: {f.code}" for f in fc.failures()]
    assert found == [], found


def test_per_row_values_on_the_cpu_warn_once_on_a_gpu():
    """A CPU vector is moved once (kept); CPU per-row values are moved every step, said once."""
    with FakeCuda() as fc:
        buf = EditBuffers(ROWS, H, torch.float32, fc.device)
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            buf.write([(np.array([0]), "add", torch.ones(H))])
            assert seen == []
            for _ in range(2):
                buf.write([(np.array([0, 1]), "add", torch.ones(2, H))])
    assert len(seen) == 1 and "make per-row edit values on the model's device" in str(
        seen[0].message
    )


def test_a_host_vector_changed_through_numpy_is_prepared_again():
    """A write through ``.numpy()`` leaves the tensor's version as it was: the kept value is
    checked against a copy of the vector, so the next step edits with the new values."""
    from tllm_core.api.edits import EditValues

    values = EditValues(torch.device("cpu"), torch.bfloat16)
    vec = torch.zeros(8)
    first, tag = values.get(vec, ablate=False)
    assert values.get(vec, ablate=False)[1] == tag  # unchanged: kept
    vec.numpy()[:] = 2.0  # no new version
    again, new_tag = values.get(vec, ablate=False)
    assert new_tag != tag and torch.equal(again, torch.full((8,), 2.0, dtype=torch.bfloat16))
    assert torch.equal(first, torch.zeros(8, dtype=torch.bfloat16))

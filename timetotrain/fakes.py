"""The one seam between ttt and fake tensors (`ttt plan --simulate`, timetotrain/train/simulate.py).

The simulator runs the production build and training step of one rank of a large job under torch's
FakeTensorMode (tensors with shapes, dtypes and devices but no storage) and the fake process group. Almost all
of ttt runs unchanged there. What cannot is here, so that nothing else needs to know about fake tensors:

- `real_host()`: host bookkeeping that must hold real values: the meta-device model (a fake mode would keep
  weak references to its tensors, and `to_empty` could then not swap them for the materialised ones), device
  meshes (rank ids in a tensor the mesh reads back) and the MoE kernel probe (it compares real numbers).
  Without a fake mode it does nothing.
- `host_sizes(counts, rows)`: the one host read of routing results, as the split sizes the MoE expert loop
  and the expert-parallel all-to-all need. A fake tensor holds no values, so the simulation assumes balanced
  routing (the rows split evenly): what `ttt plan`'s formula counts too. A real tensor is read as it is.
"""

from __future__ import annotations

import contextlib

import torch
from torch._subclasses.fake_tensor import is_fake, unset_fake_temporarily


@contextlib.contextmanager
def real_host():
    """Run host bookkeeping outside any fake-tensor mode (module docstring); a no-op without one."""
    with unset_fake_temporarily():
        yield


def host_sizes(counts: torch.Tensor, rows: int) -> list:
    """`counts.tolist()` (one host sync). Fake `counts` (shape `[n]` or `[m, n]`): `rows` split evenly over
    the last dimension, the same for every leading index."""
    # Compiled, Dynamo's tensors are fake only while it traces (and asking would break the graph once more).
    if torch.compiler.is_compiling() or not is_fake(counts):
        return counts.tolist()
    n = counts.shape[-1]
    even = [rows // n + (i < rows % n) for i in range(n)]
    return even if counts.dim() == 1 else [list(even) for _ in range(counts.shape[0])]

"""`ProgramMemTracker`: FSDP2's memory tracker, reading the program's live tensor bytes
over gloo the same way in every run.

Why: gloo runs each collective in a worker thread, and the Work it keeps holds the
collective's tensors (and gloo's own scratch: the reduce-scatter's full-size buffer)
until that thread lets go of it, a moment after the collective completes. With four
ranks on two cores that moment sometimes comes after the rank's next allocations, so a
plain tracker's peak of one step moves by up to two FSDP buffers between identical runs
(+4-5% at the calibration's sizes; seen as frees on a thread other than the rank's own).
Here a collective's tensors count as freed at the first op after the program holds no
reference to them, whichever thread frees them later. Against the plain tracker on
identical steps (learning rate 0) at world 2 and 4, where gloo let go in time: the same
peak to the byte under FSDP2, 64 bytes more (of ~470 KB) under EP=2 x FSDP2.

How: every `c10d` op (they all pass through the dispatch mode) is recorded with its
tensors and the references its Work added to each (tensor and storage use counts just
before and after the op). Tensors that first appear inside `Work.wait` are gloo's
scratch: only Python references to them count. Before each op, a recorded storage whose
remaining references are only those of the Work and of this record is taken off the
tracker's count, and its later real free is not counted again. A reference the Work
takes only when it completes (the future's on gloo's all-reduce input and all-to-all
output) is counted as the Work's when `Work.wait` follows the op with nothing in between
(every blocking collective, as expert parallelism's dispatch): the counts are taken
again around that wait. Otherwise such a tensor counts until its Work is gone, as in the
plain tracker.
"""

from __future__ import annotations

import sys

import torch
from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker
from torch.distributed._tools.mem_tracker import _UpdateType
from torch.utils._pytree import tree_leaves

_ANY = 1 << 30  # a Work's references that are not counted (gloo's scratch)


def _storage_refs(t: torch.Tensor) -> int:
    """The use count of t's storage, less the one the storage object asked for here holds."""
    return torch._C._storage_Use_Count(t.untyped_storage()._cdata) - 1


class _Recorded:
    """One collective's tensors, and how many references its Work holds on each
    (tensor, storage)."""

    def __init__(self, tensors: list, before: list | None):
        self.tensors = tensors
        if before is None:
            self.work_refs = [(_ANY, _ANY)] * len(tensors)
        else:
            self.work_refs = self._gained(before)

    def counts(self) -> list[tuple[int, int]]:
        return [(t._use_count(), _storage_refs(t)) for t in self.tensors]

    def _gained(self, before: list) -> list[tuple[int, int]]:
        return [(n - b[0], s - b[1]) for (n, s), b in zip(self.counts(), before)]

    def add_work_refs(self, before: dict) -> None:
        """Count as the Work's what each tensor gained since `before` ({id: counts} when its
        Work's wait began)."""
        gained = self._gained([before[id(t)] for t in self.tensors])
        self.work_refs = [(w[0] + g[0], w[1] + g[1]) for w, g in zip(self.work_refs, gained)]


class ProgramMemTracker(FSDPMemTracker):
    """FSDPMemTracker whose collectives' tensors count as freed when the program lets go
    of them (see the module docstring)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._recorded: list[_Recorded] = []
        self._waiting = 0
        self._last_op: _Recorded | None = None  # the collective just run, if nothing ran since

    def __enter__(self):
        from torch.distributed.distributed_c10d import Work

        self._work_wait = Work.wait

        def wait(work, *args, **kwargs):
            op, self._last_op = self._last_op, None
            if op is not None:
                before = dict(zip(map(id, op.tensors), op.counts()))
            self._waiting += 1
            try:
                return self._work_wait(work, *args, **kwargs)
            finally:
                self._waiting -= 1
                if op is not None:  # its Work, now complete, holds all it will
                    op.add_work_refs(before)

        Work.wait = wait
        return super().__enter__()

    def __exit__(self, *args):
        from torch.distributed.distributed_c10d import Work

        Work.wait = self._work_wait
        return super().__exit__(*args)

    def _program_holds(self, rec: _Recorded, idx: list[int]) -> bool:
        """Whether anything but the Work and this record still references the storage of
        rec.tensors[idx] (tensors sharing one storage)."""
        for i in idx:
            t = rec.tensors[i]
            # Python: the list's, t's and the argument's; a tensor also C++-referenced holds
            # one more on itself
            if sys.getrefcount(t) - 3 - (t._use_count() > 1) > 0:
                return True
            if t._use_count() > 1 + rec.work_refs[i][0]:
                return True
            del t
        bases = {id(b): b for i in idx if (b := rec.tensors[i]._base) is not None}
        for b in bases.values():
            # a view's base: kept alive by the view (its autograd meta) and the Python object
            # made here; the program holds it if anything else does
            if sys.getrefcount(b) - 3 - (b._use_count() > 1) > 0 or b._use_count() > 2:
                return True
        refs = len(idx) + len(bases) + max(rec.work_refs[i][1] for i in idx)
        return _storage_refs(rec.tensors[idx[0]]) > refs

    def _count_let_go(self) -> None:
        """Take off the count every recorded storage the program no longer references."""
        still = []
        for rec in self._recorded:
            by_storage: dict[int, list[int]] = {}
            for i in range(len(rec.tensors)):
                key = rec.tensors[i].untyped_storage().data_ptr()
                by_storage.setdefault(key, []).append(i)
            gone = set()
            for idx in by_storage.values():
                if self._program_holds(rec, idx):
                    continue
                winfo, _ = self._WINFO.get(rec.tensors[idx[0]].untyped_storage(), (None, None))
                if winfo is not None and winfo.mem_consumed > 0:
                    self._update_snap(_UpdateType.DEL, winfo)
                    winfo.mem_consumed = 0  # its real free, later, counts nothing
                gone.update(idx)
            if gone:
                keep = [i for i in range(len(rec.tensors)) if i not in gone]
                rec.tensors = [rec.tensors[i] for i in keep]
                rec.work_refs = [rec.work_refs[i] for i in keep]
            if rec.tensors:
                still.append(rec)
        self._recorded = still

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self._count_let_go()
        if func.namespace != "c10d" and not self._waiting:
            self._last_op = None
            return super().__torch_dispatch__(func, types, args, kwargs)
        leaves = [t for t in tree_leaves((args, kwargs)) if type(t) is torch.Tensor]
        if func.namespace == "c10d":
            tensors = list({id(t): t for t in leaves}.values())
            before = [(t._use_count(), _storage_refs(t)) for t in tensors]
            res = super().__torch_dispatch__(func, types, args, kwargs)
            if any(isinstance(w, torch.ScriptObject) for w in tree_leaves(res)):
                self._last_op = _Recorded(tensors, before)
                self._recorded.append(self._last_op)
            return res
        # inside Work.wait: a storage not seen before is gloo's scratch
        new = [t for t in leaves if t.untyped_storage() not in self._WINFO]
        res = super().__torch_dispatch__(func, types, args, kwargs)
        new = [t for t in new if t.untyped_storage() in self._WINFO]
        if new:
            self._recorded.append(_Recorded(new, None))
        return res

"""Start-up shim for hetrl's SGLang test venv (pinned to SGLang 0.5.23, torch 2.13.0+cpu,
torchvision 0.28.0). Imported by ``hetrl_sglang_startup.pth`` in the venv's site-packages.

Why: SGLang 0.5.23 imports torchvision unconditionally (sglang/srt/configs ->
multimodal/internvl_utils.py). PyPI's only torchvision for torch 2.13 (0.28.0) is a CUDA
build: its compiled ops (torchvision/_C.so) cannot load against the CPU torch wheel, and
``import torchvision`` then dies with "operator torchvision::nms does not exist" because
torchvision/_meta_registrations.py registers fake kernels for ``torchvision::nms`` and
``torchvision::qnms``. The CPU build of torchvision lives only on download.pytorch.org, which
this machine cannot reach.

What: a meta-path hook that, the first time ``torchvision`` is imported, defines the schemas of
those two ops (schemas only, no kernels). torchvision's compiled ops stay unavailable
(torchvision.ops.nms & co. raise "Couldn't load custom C++ ops"); SGLang only needs the
Python transforms.
The hook costs nothing for processes that never import torchvision (it imports torch lazily).
"""

from __future__ import annotations

import sys

_LIBS = []  # keep torch.library.Library objects alive


def register_torchvision_op_schemas() -> None:
    """Define torchvision::nms / torchvision::qnms unless torchvision's own _C already did."""
    import torch

    if _LIBS or hasattr(torch.ops.torchvision, "nms"):
        return
    lib = torch.library.Library("torchvision", "FRAGMENT")
    lib.define("nms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
    lib.define("qnms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
    _LIBS.append(lib)


class _TorchvisionHook:
    """sys.meta_path entry: on the first ``import torchvision``, register the op schemas,
    then let the normal finders load torchvision."""

    def find_spec(self, fullname, path=None, target=None):
        if fullname != "torchvision":
            return None
        sys.meta_path.remove(self)
        try:
            register_torchvision_op_schemas()
        except Exception as exc:  # never break interpreter start-up
            print(f"hetrl_sglang_startup: could not register torchvision ops: {exc!r}", file=sys.stderr)
        return None


if not any(isinstance(f, _TorchvisionHook) for f in sys.meta_path):
    sys.meta_path.insert(0, _TorchvisionHook())

"""Tests of the leangraph.schedules package itself: what it exports and what importing it costs.

The modules have tests of their own: test_schedules_megatron.py, test_schedules_pipelining.py
(with the torch-version shims of _torch_compat) and test_schedules_inspection.py.
"""

from __future__ import annotations

import subprocess
import sys

import leangraph.schedules
from leangraph.schedules import inspection, megatron, pipelining

_EXPORTS = {
    "InFlight": inspection,
    "from_pipelining": pipelining,
    "gpipe": megatron,
    "interleaved_1f1b": megatron,
    "max_in_flight": inspection,
    "one_f_one_b": megatron,
    "validate_order": inspection,
}


def test_the_package_exports_each_modules_public_names() -> None:
    assert sorted(leangraph.schedules.__all__) == sorted(_EXPORTS)
    for name, module in _EXPORTS.items():
        assert getattr(leangraph.schedules, name) is getattr(module, name), name
        assert name in module.__all__


def test_building_megatron_orders_does_not_import_torch_pipelining() -> None:
    # torch.distributed.pipelining is imported only by from_pipelining (it is slow to import,
    # and missing where torch.distributed is not available). A fresh interpreter, as this
    # one's tests have imported it already.
    code = (
        "import sys; from leangraph.schedules import interleaved_1f1b, max_in_flight; "
        "max_in_flight(interleaved_1f1b(2, 2, 0, 4)); "
        "print('torch.distributed.pipelining' in sys.modules)"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True
    )
    assert result.stdout.strip() == "False"

"""leangraph's exceptions (``leangraph.errors``), the phase note added to whatever passes
through warm-up and capture, and the catalogue: every misuse docs/errors.md lists has a test
(named ``test_<id>_...``, in the test file of the module that raises it)."""

from __future__ import annotations

import pathlib
import re

import pytest
from helpers import needs_notes, notes

import leangraph
from leangraph.errors import phase_note

DOCS = pathlib.Path(__file__).resolve().parent.parent / "docs" / "errors.md"


def test_catalogue_entries_each_have_a_test():
    ids = re.findall(r"^\| ([A-Z]\d+) \|", DOCS.read_text(), flags=re.MULTILINE)
    assert len(ids) == len(set(ids)) and len(ids) >= 30, ids
    # Each entry's test lives in the test file of the module that raises it.
    here = pathlib.Path(__file__).resolve().parent
    sources = "".join(path.read_text() for path in sorted(here.glob("test_*.py")))
    missing = [i for i in ids if not re.search(rf"def test_{i.lower()}_", sources)]
    assert not missing, f"catalogue entries without a test: {missing}"


def test_leangraphs_own_errors_are_runtime_errors():
    assert issubclass(leangraph.LeangraphError, RuntimeError)
    assert issubclass(leangraph.GraphResetError, leangraph.LeangraphError)
    assert issubclass(leangraph.CaptureMemoryError, leangraph.LeangraphError)


def test_a_capture_memory_error_states_the_figures_and_the_step():
    error = leangraph.CaptureMemoryError(3 * 2**20 + 2**19, 2**20, "capture step 1 (B c1 m0 l0)")
    assert (error.needed_bytes, error.available_bytes) == (3 * 2**20 + 2**19, 2**20)
    assert error.step == "capture step 1 (B c1 m0 l0)"
    assert str(error) == (
        "capture needs 3.5 MiB at its peak (capture step 1 (B c1 m0 l0)) but only 1.0 MiB of "
        "GPU memory is available; free memory, use fewer microbatches in flight, or pass "
        "check_memory=False to try anyway"
    )


@needs_notes
@pytest.mark.parametrize("kind", [ValueError, KeyboardInterrupt])
def test_the_phase_note_names_phase_callable_and_step_and_leaves_the_exception_alone(kind):
    error = kind("boom")
    with pytest.raises(kind) as info:
        with phase_note("capture", "callable 1 (Block)", "capture step 3 (B c1 m0 l1)"):
            raise error
    assert info.value is error and str(info.value) == "boom"
    assert notes(error) == (
        "leangraph: raised during capture of callable 1 (Block), at capture step 3 (B c1 m0 l1)"
    )


def test_the_phase_note_passes_quietly_when_nothing_is_raised():
    with phase_note("warm-up", "callable 0 (Block)", "warm-up pass 0, step 0"):
        result = 1 + 1
    assert result == 2

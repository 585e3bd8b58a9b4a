import shutil
import sys
import tempfile
from pathlib import Path

import pytest

# test helpers (k3fixtures, refutil) live beside the tests
sys.path.insert(0, str(Path(__file__).resolve().parent))

_ISA_TEST = "test_every_instruction_set_path_gives_the_same_bits"
_early = []   # (module, folder) of the instruction-set processes started below


@pytest.hookimpl(trylast=True)     # after -k / -m have deselected what they do
def pytest_collection_modifyitems(session, config, items):
    """Once the tests are known: if the instruction-set test is among them, start its
    other-path compiles now (fresh processes, a minute or more each), so they run on the
    other core while the first tests run, instead of in series when that test comes."""
    for item in items:
        if item.name == _ISA_TEST:
            mod = item.module
            folder = Path(tempfile.mkdtemp(prefix="k3-isa-"))
            mod.EARLY_PATHS = (folder, mod.start_other_paths(folder))
            _early.append((mod, folder))
            break


def pytest_sessionfinish(session, exitstatus):
    for mod, folder in _early:      # nothing left running, nothing left behind
        for p in mod.EARLY_PATHS[1].values():
            if p.poll() is None:
                p.kill()
                p.wait()
        shutil.rmtree(folder, ignore_errors=True)

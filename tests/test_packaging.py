"""Installing the project must not change what transformers sees."""

from __future__ import annotations

import importlib.metadata
import subprocess
import sys

import pytest


def test_kernels_install_under_their_own_name_not_as_top_level_kernels(tmp_path):
    try:
        importlib.metadata.distribution("kernels")
        pytest.skip("the unrelated `kernels` distribution is installed here")
    except importlib.metadata.PackageNotFoundError:
        pass
    code = (
        "import importlib.util, rollout_kernels;"
        "from transformers.utils.import_utils import is_kernels_available;"
        "print(importlib.util.find_spec('kernels') is None, is_kernels_available())"
    )
    # From a neutral directory, as a user's script would run.
    out = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["True", "False"]

"""The connector runs only in a vLLM it supports, and says which ones when it refuses."""

import pytest

from contextkit.core.errors import ConfigError
from contextkit.integrations.vllm_connector.compat import SUPPORTED_VLLM, check_vllm_version


def test_the_installed_vllm_is_supported():
    vllm = pytest.importorskip("vllm")
    assert check_vllm_version(vllm.__version__) in SUPPORTED_VLLM


@pytest.mark.parametrize("version", ["0.32.0", "0.32.1+cpu", "0.32.2rc1"])
def test_releases_and_local_builds_of_the_supported_line_pass(version):
    assert check_vllm_version(version).release[:2] == (0, 32)


@pytest.mark.parametrize("version", ["0.31.2", "0.33.0", "1.0.0", "0.10.1", "0.32.0.dev12+g1234"])
def test_an_unsupported_vllm_is_refused_with_the_supported_range(version):
    with pytest.raises(ConfigError, match=r"supports vLLM <0\.33,>=0\.32|supports vLLM >=0\.32,<0\.33") as e:
        check_vllm_version(version)
    assert version in str(e.value)


def test_a_version_that_is_not_one_is_refused_clearly():
    with pytest.raises(ConfigError, match="cannot read the installed vLLM's version"):
        check_vllm_version("not-a-version")

"""Fixtures shared by the apex_compat tests."""
import pytest

from ampkit import apex_compat


@pytest.fixture
def standin(monkeypatch):
    """ampkit installed as the ``apex`` stand-in for one test (whatever the environment says)."""
    monkeypatch.delenv(apex_compat.ENV, raising=False)
    assert apex_compat.install() is True
    yield
    apex_compat.uninstall()

"""Run metadata outside the happy path: no git checkout, a package that is not installed (the
2-rank run in test_training.py checks the metadata of a real run)."""

import pytest

from pinads_rec.training.run_log import git_state, package_versions


@pytest.mark.slow
def test_outside_a_git_checkout_the_commit_is_unknown(tmp_path):
    assert git_state(tmp_path) == ("unknown", None)


def test_a_package_that_is_not_installed_says_so():
    assert package_versions(("torch", "no_such_package_here")) == {
        "torch": __import__("torch").__version__,
        "no_such_package_here": "not installed",
    }

"""Repo-root conftest for the project's own test suite."""

pytest_plugins = ["pytester"]

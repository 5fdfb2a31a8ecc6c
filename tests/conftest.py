"""Shared test set-up: the integration fixtures (real server, local site) are available to every test module."""

pytest_plugins = ["integration_fixtures"]

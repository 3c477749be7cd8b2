from tests.e2e.conftest import default_model  # noqa: F401 - the fixture, shared

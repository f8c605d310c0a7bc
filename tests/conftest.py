import pytest


def pytest_addoption(parser):
    parser.addoption("--world-size-8", action="store_true", default=False,
                     help="also run the multi-rank tests with 8 ranks (slow on few cores)")


def pytest_configure(config):
    config.addinivalue_line("markers", "world_size_8: needs 8 ranks; runs only with --world-size-8")


def pytest_collection_modifyitems(config, items):
    if config.getoption("--world-size-8"):
        return
    skip = pytest.mark.skip(reason="8-rank run: pass --world-size-8")
    for item in items:
        if "world_size_8" in item.keywords:
            item.add_marker(skip)

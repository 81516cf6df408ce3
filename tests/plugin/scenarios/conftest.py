import pytest


class Widget:
    def __init__(self, n):
        self.n = n


@pytest.fixture
def widget():
    return Widget(7)


@pytest.fixture
def unpicklable():
    return lambda: None

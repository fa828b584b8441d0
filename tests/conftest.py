import warnings

import pytest
import torch

from dpcore import SeededRandomnessWarning


@pytest.fixture(autouse=True)
def _quiet_seeded_warning():
    # Tests use seeded randomness on purpose; test_randomness checks that the warning exists.
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", SeededRandomnessWarning)
        yield


@pytest.fixture(autouse=True)
def _deterministic_threads():
    torch.set_num_threads(1)
    yield

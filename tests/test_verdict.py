"""The verdict the chapters glue beside a before/after pair of measurements."""

import pytest

from tinyvllm_lib.plots import DEFAULT_NOISE, verdict


def test_times_without_repeats_use_the_default_noise():
    # chapter 11's attention at 64 rows: 50.3 us before, 42.1 after
    assert verdict(50.3, 42.1) == "faster by 16%"
    assert verdict(42.1, 50.3) == "slower by 19%"
    assert verdict(100.0, 100.0 * (1 - DEFAULT_NOISE / 2)).startswith("within noise")


def test_rates_are_better_when_higher():
    assert verdict(100.0, 120.0, higher_is_better=True) == "faster by 20%"
    assert verdict(100.0, 80.0, higher_is_better=True) == "slower by 20%"


def test_the_spread_of_repeats_is_the_noise():
    # a 10% change is noise when the repeats spread over 30%...
    noisy = verdict([85.0, 100.0, 115.0], [90.0])
    assert noisy == "within noise (±30%)"
    # ...and a 3% change is not when they spread over 1% (below the default)
    assert verdict([99.5, 100.0, 100.5], [97.0, 97.0, 97.0]) == "faster by 3%"
    # the median is compared, not the mean
    assert verdict([100.0, 100.0, 400.0], [50.0, 50.0, 50.0], noise=0.1) == (
        "faster by 50%"
    )


def test_stated_noise_and_words():
    assert verdict(10.0, 10.4, noise=0.01) == "slower by 4%"
    assert verdict(10.0, 10.4, noise=0.05) == "within noise (±5%)"
    assert verdict(10.0, 8.0, words=("shorter", "longer")) == "shorter by 20%"


@pytest.mark.parametrize("before", [0.0, [0.0, 0.0]])
def test_a_zero_before_has_no_relative_change(before):
    with pytest.raises(ValueError):
        verdict(before, 1.0)

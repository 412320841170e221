"""Tick labels of the shared plotting helper: plain numbers on log axes."""

import matplotlib

matplotlib.use("Agg")

from tinyvllm_lib.plots import new_figure, plain_log_ticks  # noqa: E402


def test_log_ticks_read_as_plain_numbers():
    fig, ax = new_figure()
    ax.set_yscale("log")
    ax.set_ylim(4, 60)
    plain_log_ticks(ax)
    major, minor = ax.yaxis.get_major_formatter(), ax.yaxis.get_minor_formatter()
    assert major(10, 0) == "10"
    # the 2, 3 and 5 multiples are labelled, plainly; the others are left blank
    assert [minor(v, 0) for v in (5, 6, 20, 30, 40)] == ["5", "", "20", "30", ""]
    assert minor(0.3, 0) == "0.3"
    matplotlib.pyplot.close(fig)

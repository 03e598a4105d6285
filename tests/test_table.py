"""hiersync._table: the one layout of the reports' tables (plain text and markdown)."""

from __future__ import annotations

import pytest

from hiersync._table import render

HEAD = ["schedule", "compute", "step s", "vs DDP"]
ROWS = [["ddp", "cpu", "0.100", "1.00x"], ["hiersync_p4_stream", "accel", "12.500", "0.25x"], ["x", "cpu", "n/a"]]


def test_plain_columns_two_spaces_apart_names_left_numbers_right():
    assert render(HEAD, ROWS, align="llr").splitlines() == [
        "schedule            compute  step s  vs DDP",
        "ddp                 cpu       0.100   1.00x",
        "hiersync_p4_stream  accel    12.500   0.25x",
        "x                   cpu         n/a",  # a short row: empty cells, no trailing spaces
    ]
    # the default: one name column; "r": numbers only
    assert render(["a", "b", "c"], [["x", "1", "22"]]).splitlines() == ["a  b   c", "x  1  22"]
    assert render(["size", "op"], [["4K", "rail"]], align="r").splitlines() == ["size    op", "  4K  rail"]


def test_markdown_pipe_table_says_the_alignment():
    lines = render(HEAD, ROWS, align="llr", markdown=True).splitlines()
    assert [c.strip() for c in lines[0].strip("|").split("|")] == HEAD
    sep = [c.strip() for c in lines[1].strip("|").split("|")]
    assert [s.startswith(":") for s in sep] == [True, True, False, False]
    assert [s.endswith(":") for s in sep] == [False, False, True, True]
    assert [[c.strip() for c in line.strip("|").split("|")] for line in lines[2:]] == [
        ROWS[0],
        ROWS[1],
        ["x", "cpu", "n/a", ""],
    ]


def test_cells_are_printed_as_given():
    # tabulate would parse "0.100" and print 0.1, and "1e3" as 1000
    text = render(["a", "b"], [["0.100", "1e3"], ["-", "+0.0100 (-0.01..+0.03)"]])
    assert "0.100" in text and "1e3" in text and "+0.0100 (-0.01..+0.03)" in text


def test_align_names_the_fault():
    with pytest.raises(ValueError, match="align='lc'"):
        render(HEAD, ROWS, align="lc")


def test_indent_starts_every_line_of_a_plain_table():
    plain = render(HEAD, ROWS)
    assert render(HEAD, ROWS, indent="  ").splitlines() == ["  " + line for line in plain.splitlines()]

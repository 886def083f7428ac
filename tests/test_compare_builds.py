"""benchmarks/compare_builds.py: argument parsing and the table (the timing itself runs on the GPU machine)."""

import argparse
from pathlib import Path

import pytest

from benchmarks import compare_builds


def test_parsers_read_builds_shapes_and_tokens():
    assert compare_builds.parse_build("new=/tmp/x/libjax_w4a4.so") == ("new", Path("/tmp/x/libjax_w4a4.so"))
    assert compare_builds.parse_shapes("28672x8192,576x1536") == [(28672, 8192), (576, 1536)]
    assert compare_builds.parse_tokens("1,16,64") == [1, 16, 64]


@pytest.mark.parametrize(
    "parser, spec, message",
    [
        (compare_builds.parse_build, "new", "name=path"),
        (compare_builds.parse_build, "=lib.so", "name=path"),
        (compare_builds.parse_shapes, "4096x", "AxB"),
        (compare_builds.parse_shapes, "4096*4096", "AxB"),
        (compare_builds.parse_tokens, "1,0", "positive"),
        (compare_builds.parse_tokens, "16,a", "positive"),
    ],
)
def test_parsers_name_the_argument_and_the_expected_form(parser, spec, message):
    with pytest.raises(argparse.ArgumentTypeError, match=message):
        parser(spec)


def test_table_gives_each_builds_range_and_its_median_against_the_first():
    runs = {
        "head": [{"8192x8192 M=1": 14.0, "8192x8192 M=16": 18.0}, {"8192x8192 M=1": 14.2, "8192x8192 M=16": 18.4}],
        "new": [{"8192x8192 M=1": 13.0, "8192x8192 M=16": 18.2}, {"8192x8192 M=1": 13.2, "8192x8192 M=16": 18.2}],
    }
    rows = compare_builds.table_rows(["head", "new"], runs)
    assert [row.label for row in rows] == ["8192x8192 M=1", "8192x8192 M=16"]
    assert rows[0].cells == {"head us": "14.00-14.20", "new us": "13.00-13.20", "new / head": f"{13.1 / 14.1:.3f}"}
    assert rows[1].cells == {"head us": "18.00-18.40", "new us": "18.20-18.20", "new / head": f"{18.2 / 18.2:.3f}"}


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--build", "head={missing}"], "no such file"),
        (["--build", "a={lib}", "--build", "a={lib}"], "names must differ"),
        (["--build", "a={lib}", "--rounds", "0"], "at least 1"),
        (["--build", "a={lib}", "--op", "act_quant", "--formats", "int4,int8"], "int4, uint4 and fp8"),
        (["--build", "a={lib}", "--op", "w4a8"], "invalid choice"),
    ],
)
def test_main_rejects_bad_arguments_before_running_anything(tmp_path, capsys, argv, message):
    lib = tmp_path / "libjax_w4a4.so"
    lib.write_bytes(b"")
    argv = [arg.format(lib=lib, missing=tmp_path / "missing.so") for arg in argv]
    with pytest.raises(SystemExit):
        compare_builds.main(argv)
    assert message in capsys.readouterr().err

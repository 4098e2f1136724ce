"""``raggedfsdp bench``'s table (app/bench/report.py) on a real result: a 2-rank dense bench's ``--json``
object (tests/unit/data/bench_result.json, 2 steps, whose optimizer-step differences came out
negative). A negative difference gets one line saying it is noise, and only then."""

from __future__ import annotations

import copy
import json
from pathlib import Path

from raggedfsdp.app.bench.report import format_report

RESULT = json.loads((Path(__file__).parent / "data" / "bench_result.json").read_text())
NOTE = "(a negative difference is below this run's noise"


def _positive(r: dict) -> dict:
    r = copy.deepcopy(r)
    for s in r["non_comm_overhead_main_thread_split"].values():
        for k in s:
            s[k] = abs(s[k])
    return r


def test_every_row_is_printed_with_its_values():
    text = format_report(RESULT)
    a, b = RESULT["raggedfsdp"], RESULT["torch"]
    assert f"{a['final_loss']:16.6f}{b['final_loss']:16.6f}" in text
    assert f"{a['collectives']:16d}{b['collectives']:16d}" in text
    split = RESULT["non_comm_overhead_main_thread_split"]
    assert f"{split['raggedfsdp']['optimizer'] * 1e3:13.1f} ms" in text
    assert "implicit redistrib." in text  # an older result without the key prints 0
    assert text.count("\n") + 1 == 26, text


def test_a_negative_difference_is_called_noise():
    assert min(RESULT["non_comm_overhead_main_thread_split"]["raggedfsdp"].values()) < 0
    assert format_report(RESULT).splitlines()[-1].startswith(NOTE)
    assert NOTE not in format_report(_positive(RESULT))
    r = _positive(RESULT)
    r["non_comm_overhead_seconds"]["torch"] = -0.001  # any of the differences
    assert NOTE in format_report(r)


def test_quantize_row_shows_ms_and_the_share_of_the_step():
    r = copy.deepcopy(RESULT)
    a = r["raggedfsdp"]
    a.update(quantize_seconds=0.002, dequantize_seconds=0.003, quantize_calls=3, dequantize_calls=5)
    r["torch"].update(quantize_seconds=0.0, dequantize_seconds=0.0)
    line = next(ln for ln in format_report(r).splitlines() if ln.startswith("quantize/dequant ms"))
    assert "2.00 / 3.00" in line and "0.00 / 0.00" in line, line
    assert f"{0.005 / a['step_seconds_median']:.1%} of the raggedfsdp step" in line, line
    assert "(3 / 5 calls" in line
    # an older result without the keys: 0
    assert "0.00 / 0.00" in next(ln for ln in format_report(RESULT).splitlines() if "quantize/dequant" in ln)

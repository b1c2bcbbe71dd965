"""The excerpt of a cluster's logs that a failed test's report carries."""

from __future__ import annotations

from tests.cluster_logs import cluster_log_sections, log_excerpt, log_records

LOG = """\
2026-11-27 20:56:04,396 INFO a event=one
2026-11-27 20:56:04,397 ERROR a event=worker_session_failed
Traceback (most recent call last):
  File "x.py", line 1, in <module>
RuntimeError: boom
2026-11-27 20:56:04,398 INFO a event=two
2026-11-27 20:56:04,399 WARNING a event=three
2026-11-27 20:56:04,400 INFO a event=four
"""


def test_a_record_keeps_its_traceback():
    records = log_records(LOG)
    assert len(records) == 5
    assert records[1].endswith("RuntimeError: boom")


def test_warnings_and_errors_then_the_last_records_each_once():
    excerpt = log_excerpt(LOG, num_last=2)
    assert "event=one" not in excerpt and "event=two" not in excerpt
    assert excerpt.index("worker_session_failed") < excerpt.index("RuntimeError: boom") \
        < excerpt.index("event=three") < excerpt.index("event=four")
    assert excerpt.count("event=three") == 1


def test_a_long_excerpt_keeps_its_end():
    excerpt = log_excerpt(LOG, max_chars=20)
    assert excerpt == "..." + LOG.rstrip("\n")[-20:]


def test_one_section_per_process_log(tmp_path):
    (tmp_path / "worker-1.log").write_text(LOG)
    (tmp_path / "scheduler.log").write_text("")
    (tmp_path / "notes.txt").write_text("not a log")
    assert [title for title, _ in cluster_log_sections(tmp_path)] == \
        ["log scheduler.log", "log worker-1.log"]

"""Offline batch jobs: OpenAI Batch API files run through the Generator's engine, resumably.

``zgen.batch.run(model, "requests.jsonl", "results.jsonl", prefix_cache(...))`` or ``zgen batch
--model M --input requests.jsonl --output results.jsonl``; see :mod:`zgen.batch.job` for the path of a
job, :mod:`zgen.batch.format` for the file format and :mod:`zgen.batch.output` for what a crash can lose.
"""

from zgen.batch.format import BatchRequest, LineError, parse_line
from zgen.batch.job import BatchSummary, run
from zgen.batch.output import ResultsFile

__all__ = ["BatchRequest", "BatchSummary", "LineError", "ResultsFile", "parse_line", "run"]

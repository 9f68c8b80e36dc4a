"""Offline batch jobs: OpenAI Batch API files run through the Generator's engine, resumably.

``zgen.batch.run(model, "requests.jsonl", "results.jsonl", prefix_cache(...))`` or ``zgen batch
--model M --input requests.jsonl --output results.jsonl``; see :mod:`zgen.batch.job` for the path of a
job, :mod:`zgen.batch.format` for the file format, :mod:`zgen.batch.adapters` for LoRA modules chosen
per request, :mod:`zgen.batch.output` for what a crash can lose and :mod:`zgen.batch.summary` for the
summary read from the engines' metrics.
"""

from zgen.batch.adapters import LoraModules, register_modules
from zgen.batch.format import BatchRequest, LineError, parse_line
from zgen.batch.job import run
from zgen.batch.output import ResultsFile
from zgen.batch.summary import BatchSummary, Percentiles

__all__ = ["BatchRequest", "BatchSummary", "LineError", "LoraModules", "Percentiles", "ResultsFile", "parse_line", "register_modules", "run"]

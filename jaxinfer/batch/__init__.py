"""Config-driven, resumable offline batch generation (`jaxinfer batch JOB.yaml|JOB.gin`)."""

from jaxinfer.batch.job import BatchJob, load_job
from jaxinfer.batch.runner import run_job

__all__ = ["BatchJob", "load_job", "run_job"]

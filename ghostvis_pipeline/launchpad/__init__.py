"""The Dagster jobs the UI's launchpad runs beside the assets: the asset jobs (the shard data,
the training chain, the checks alone), the trace job and the model export job. These are Dagster jobs; the
training process a launcher starts is the run's job (ghostvis_core/runs/job_command.py)."""

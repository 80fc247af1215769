"""The run's records: what the launch side writes for a run and the job and the audit read.

The launch spec, the run result, finding runs in the store, failure reasons, a run's files by URI, what a
launcher starts (the job) and the pre-flight's findings. Below both launch/ and run/: the launch side, the
job, the pipeline and the audit read records from here, never from the training package."""

"""The host side of the process boundary: what runs where a run is planned and launched (the Dagster
process, the `ghostvis` CLI), never in the job. `start.py` resolves a stage run, selects its shards,
derives its identity and saves its launch record once; `cluster/` renders what a scheduler needs to start
the job (the torchrun command line, an sbatch script, Kubernetes manifests). What crosses to the job is
the launch record (ghostvis_core/runs/launch_spec.py) and a Job (ghostvis_core/runs/job_command.py); the job's side is
ghostvis_core/run/."""

"""Where a stage's ranks run: the torchrun command line, an sbatch script, Kubernetes manifests.

Plain functions that render what a scheduler needs from a launch spec; the Dagster launchers
(ghostvis_pipeline/launchers/) submit and follow them. The training entry point is the same everywhere.
"""

"""Libra as a Slurm job (deploy/slurm/libra.sbatch runs `python -m libra.slurm.job`).

layout.py decides where every part runs on the allocation and how it is reached (a pure core);
job.py starts the parts as srun steps (steps.py), restarts a crashed one, and stops them in order;
slurmctl.py is what it asks Slurm and tells it (scontrol, squeue, sinfo, scancel);
redis_step.py is the Redis step (password, the job's network, AOF, outlives the services' drain).
Must not know: what the services do inside (they are `libra serve SERVICE` with one config).
"""

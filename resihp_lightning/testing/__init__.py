"""Test helpers shared by ``tests/`` and ``benchmarks/``: real gloo processes with a hang timeout
(:mod:`.multiproc`), jobs whose ranks die on purpose (:mod:`.harness`), synthetic timing traces
(:mod:`.synthetic`), a brute-force planning oracle and small random problems (:mod:`.brute_oracle`),
the toy models, data and one-process references the training tests share (:mod:`.toy_jobs`), a
restartable job (:mod:`.elastic_job`), separate machines out of Linux namespaces (:mod:`.machines`)
a torchrun job across them (:mod:`.torchrun_machines`, :mod:`.machines_job`) and a SLURM batch script
across them with srun emulated (:mod:`.slurm_machines`, :mod:`.fake_slurm`). Not used by the library
itself."""

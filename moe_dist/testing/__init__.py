"""Tools to test the project as its users run it: several nodes on one machine (:mod:`.cluster`),
a real Slurm cluster on this machine or on those nodes (:mod:`.slurm`)."""

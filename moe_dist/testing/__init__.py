"""Tools to test the project as its users run it: several nodes on one machine (:mod:`.cluster`)."""

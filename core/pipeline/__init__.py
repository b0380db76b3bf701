"""The save and load pipelines: save (the order: flatten -> plan -> stage -> write -> commit), its steps, load, device reads, workers and handles."""

"""What a run is: its config, the run spec resolved from it and the target, the shapes, the schedule,
the layers a drafter reads, and what decides whether a checkpoint resumes it. No torch here."""

"""What a run leaves on disk: its dir and lock (`run_dir`), its log file (`run_log`), its checkpoints, whole or sharded
(`checkpoints`), every key they hold beyond Lightning's and its owner (`saved_state`), and the metrics file a resumed
run continues (`history`)."""

from qerl_pipe.cli import main

main()

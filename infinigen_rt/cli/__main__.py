from infinigen_rt.cli.main import main

main()

from torchneox.cli import main

if __name__ == "__main__":  # not when a spawned process imports the main module again
    raise SystemExit(main())

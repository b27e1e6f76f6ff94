from torchneox.cli import main

raise SystemExit(main())

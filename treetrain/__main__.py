from treetrain.cli.main import main

raise SystemExit(main())

from bufc.codegen.cli import main

raise SystemExit(main())

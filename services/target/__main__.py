from services.process.exits import end_process
from services.target.worker import main

end_process(main())

"""asyncio actors around the engine core: scheduler, workers, and the AsyncEngine facade."""

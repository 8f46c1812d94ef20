"""Evaluations: teacher-forced KLD, needle retrieval, calibration."""

"""What is read and written: safe file opening (input_files), images, pairs files, JSON fields, atomic writes."""

from tfscale.data.convert import convert

if __name__ == "__main__":  # not in conversion worker processes, which import the main module again
    convert.run()
